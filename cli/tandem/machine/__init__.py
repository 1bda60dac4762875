"""This machine: hardware facts, hardware profiles, the memory/offload planner."""
