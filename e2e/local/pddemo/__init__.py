"""The parts of the demo (e2e/local/demo.py is the program over them): the workload
drawn from traces, its replay through the router, what the cluster says, the live view
and the cluster's set-up."""
