"""The local stack: emulated replicas + epp + dev gateway, the demo workload and its report.

``start_stack`` starts the three parts on free loopback ports; ``run_workload`` drives a
shared-prefix chat workload through the gateway; ``run_demo`` does both for epp and a
baseline and writes the comparison (table + PNG).
"""

from simulator.stack.stack import Stack, StackError, StackOptions, start_stack

__all__ = ["Stack", "StackError", "StackOptions", "start_stack"]
