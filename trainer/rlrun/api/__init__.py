"""The rlrun API: the types other programs and people write against (KubeRay's ``apis/`` is the model).

| module | what | read by |
|---|---|---|
| :mod:`.spec` | ``RLRun`` manifest models: ``RLRun.spec``, the single source of a run's settings | every ``rlrun`` command, the operator, the CRD |
| :mod:`.status` | ``RLRun.status`` models and the words it uses: phases, condition types, reasons, Event reasons | the operator (its one writer), the CRD, tests |
| :mod:`.crd` | the ``RLRun`` CustomResourceDefinition generated from the two above (``rlrun crd``) | ``crds/``, the Helm chart |
| :mod:`.control` | the operator ↔ orchestrator contract: what the control server's routes answer | the orchestrator's control server, the client |
| :mod:`.control_client` | the one client of that contract | the operator, ``rlrun local``, tests |

Models and their one client: reading manifests is :mod:`rlrun.manifest`; nothing here imports the rest of
``rlrun`` (the import test keeps the product free of cycles). Import the modules
themselves (``from rlrun.api.spec import RLRun``); this package re-exports nothing.
"""
