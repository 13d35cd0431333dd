"""mdloader: a distributed, file-system-friendly loader of DeePMD data systems.

The public names follow DeePMD-kit's PyTorch backend so that switching is an import change.
"""

from __future__ import annotations

__version__ = "0.1.0"
