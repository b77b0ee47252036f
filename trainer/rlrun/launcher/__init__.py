"""Launchers that start a run's processes: ``local`` runs them on this machine."""
