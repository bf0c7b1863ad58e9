"""The local preemption drill: a laptop stand-in for a Spot VM that proves the boot path resumes.

Owns the loopback fakes, which the trainer tests share (the GCE metadata server, the
gcp-storage-emulator launcher, free ports); the VM sandbox (mount + PID namespaces over throwaway
dirs); the service-manager stand-in that replaces systemd there; and the drill that preempts a
real training run K times and checks its final model digest against an uninterrupted run's.
"""
