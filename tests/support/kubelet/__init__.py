"""A cluster on this machine whose pods are real processes: the end-to-end tests' kubelet stand-in.

``scheduling`` (which node a pod may run on), ``containers`` (a pod's container as a process in
a mount namespace of its own), ``nodes`` (scheduler, kubelets, pod GC and DNS of fake nodes;
node loss with notice or abrupt), ``cluster`` (the API emulator, the nodes and the real
``rlrun operator`` process together). Test support, not product: see each module for how it
differs from Kubernetes and what it does to the host.
"""

from .cluster import FAKE_ROLLOUT_IMAGE_ENV, LocalCluster
from .nodes import LocalNodes

__all__ = ["FAKE_ROLLOUT_IMAGE_ENV", "LocalCluster", "LocalNodes"]
