"""Control: the controller and the rules of what users do to workloads, over the store."""
