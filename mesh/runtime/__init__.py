"""The asyncio runtime around the policy core. It reads time only from the event loop."""
