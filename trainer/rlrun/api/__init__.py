"""The rlrun API: the types other programs and people write against (KubeRay's ``apis/`` is the model).

| module | what | read by |
|---|---|---|
| :mod:`.spec` | ``RLRun`` manifest models: ``RLRun.spec``¹ | every ``rlrun`` command, the operator, the CRD |
| :mod:`.status` | ``RLRun.status`` models and the words it uses² | the operator (its one writer), the CRD, tests |
| :mod:`.crd` | the ``RLRun`` CustomResourceDefinition from the two above (``rlrun crd``) | ``crds/``, the Helm chart |
| :mod:`.control` | the operator ↔ orchestrator contract³ | the orchestrator's control server, the client |
| :mod:`.control_client` | the one client of that contract | the operator, ``rlrun local``, tests |

¹ The single source of a run's settings. ² Phases, condition types, reasons, Event reasons. ³ What the control
server's routes answer.

Models and their one client: reading manifests is :mod:`rlrun.manifest`; nothing here imports the rest of
``rlrun`` (the import test keeps the product free of cycles). Import the modules
themselves (``from rlrun.api.spec import RLRun``); this package re-exports nothing.
"""
