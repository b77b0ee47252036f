"""Test support shared by several test packages (binaries, Kubernetes API emulator)."""
