"""The parallel part: processes, groups and what is split over them.

Owns the processes and their groups (`distributed`: launch, the world, the watchdog that ends a job whose node
died, the config check across nodes), Ulysses sequence parallelism for `anchor train` (`ulysses`: heads split
over the ranks of a group, the window's slots over its ranks), and the ZeRO-3 build that gives each rank its
slice of each tensor (`sharded_build`). Context parallelism belongs here.

May import: the attention and model parts, the config part, anchor_core, torch, DeepSpeed.
"""
