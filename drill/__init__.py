"""The local preemption drill: a laptop stand-in for a Spot VM that proves the boot path resumes.

Owns the fake GCE metadata server, the VM sandbox (mount + PID namespaces over throwaway dirs),
the service-manager stand-in that replaces systemd there, and the drill that preempts a real
training run K times and checks its final model digest against an uninterrupted run's.
"""
