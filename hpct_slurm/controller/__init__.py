"""The batch-host controller: one step per node, warm spares, detection, relaunch."""
