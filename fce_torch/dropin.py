"""What the drop-in modules (fce_torch.liger, fce_torch.cce) share."""


def keep_arguments(module, arguments):
    """Keep a module's constructor arguments (its ``locals()``) as attributes of the same names, as the peers'
    modules do; their forward reads them."""
    for name, value in arguments.items():
        if name not in ("self", "__class__"):
            setattr(module, name, value)


def check_flag(name, value):
    """A peer's boolean argument (ValueError naming it, where the peer asserts)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
