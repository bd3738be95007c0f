"""What runs in the control service and decides: the fleet (nodes and their instances), the
dispatcher, the schedulers, agent clients and their supervisor, the weights plane."""
