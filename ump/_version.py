__version__ = "0.1.0"

#: ump's name on the package index; the import name is ``ump``.
DISTRIBUTION = "ump-unified-memory"


def pip_install(*extras: str) -> str:
    """The command that installs ump with one of ``extras``:
    ``pip install ump-unified-memory[cuda12] or ...[cuda13]``."""
    return "pip install " + " or ".join(f"{DISTRIBUTION}[{extra}]" for extra in extras)
