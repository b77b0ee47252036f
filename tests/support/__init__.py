"""Test support shared by several test packages (binaries, offline CRD checks, Kubernetes API emulator)."""
