"""``disagg plan``: hardware profiles, cost curves, a discrete-event simulator of colocated and
disaggregated serving, and the search for P:D plans; plus the per-request placement rule that a
decode node shares with the simulator."""
