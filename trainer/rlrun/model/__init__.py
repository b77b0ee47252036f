"""Policy models: the builtin tiny model and resolution of a ``spec.model`` to loadable weights."""
