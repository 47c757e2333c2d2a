"""The workload runner: commands from the controller, training processes, the client
library they import (docs/workloads.md).  Importing this package pulls in nothing, so
``agent.workload.client`` stays standard-library only."""
