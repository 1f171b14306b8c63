"""radixserve: an LLM serving stack with radix-tree prefix reuse.

`from radixserve import Engine` gives the in-process engine; the import is lazy so
that services which never touch the model do not pay for torch at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine

__all__ = ["Engine", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.engine.engine import Engine

        return Engine
    raise AttributeError(name)
