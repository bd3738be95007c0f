"""What runs in the control service and decides: the cluster view, the dispatcher, the
schedulers, agent clients and their supervisor, the weights plane."""
