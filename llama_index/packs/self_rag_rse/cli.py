"""The ``self-rag-rse`` command: ``download-llamapack`` with the legacy CLI's shape, offline.

``self-rag-rse download-llamapack SelfRAGPack --download-dir ./pack`` (or
``python -m llama_index.packs.self_rag_rse ...``) does what
``llamaindex-cli download-llamapack`` did for other packs, by :func:`.download.download_llama_pack`.
``self-rag-rse evaluate --docs DIR --qa FILE.jsonl --out OUTDIR`` compares top-k, RSE and Self-RAG
engines on your data (:mod:`.evaluation.command`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from llama_index.packs.self_rag_rse.download import DISTRIBUTION, download_llama_pack, public_names
from llama_index.packs.self_rag_rse.evaluation.command import add_evaluate_parser, run_evaluate

PROG = "self-rag-rse"

DESCRIPTION = f"""\
Tools for {DISTRIBUTION}.

evaluate compares top-k retrieval, RSE, Self-RAG, Self-RAG with RSE and the corrective
loop on your documents and questions (RAGAS or LlamaIndex evaluators, evidence
recall/precision, latency, model calls) and writes a report. Offline by default.

download-llamapack copies this pack's source into a folder of yours, as
`llamaindex-cli download-llamapack` does for other packs, without the network and on
any llama-index-core 0.14.x.

Why not llamaindex-cli: llama-index-cli 0.5.7 (the last, deprecated) dies at import on
llama-index-core >= 0.14.21 (No module named 'llama_index.core.download'), even for
--help. On core <= 0.14.20 it maps class names through core's bundled mappings.json,
where SelfRAGPack is the upstream llama-index-packs-self-rag (a different pack), and it
lists files from the run-llama GitHub tree whatever URL is given.
"""

DOWNLOAD_EPILOG = """\
The folder receives a self-contained project: pyproject.toml, README.md, LICENSE,
CHANGELOG.md and llama_index/packs/self_rag_rse/. Then either
  pip install -e DIR     (the copy becomes the installed pack; it replaces the current
                          llama-index-packs-self-rag-rse install: same distribution name)
  PYTHONPATH=DIR python your_app.py   (the copy shadows the installed pack in that process)

Requirements of the copy (and of --extra groups) that this environment lacks are
installed with pip; installed packages are never upgraded. --no-install only prints the
pip command. A non-empty folder is never overwritten unless it already holds an
identical copy or --overwrite is given.
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``self-rag-rse`` command."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    download = commands.add_parser(
        "download-llamapack",
        help="copy the pack's source into a folder, install missing requirements",
        description="Copy this pack's source into DIR and report the class found there.",
        epilog=DOWNLOAD_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    download.add_argument(
        "llama_pack_class",
        metavar="CLASS",
        help="a public name of the pack: SelfRAGPack, SelfRAGQueryEngine, "
        "RelevantSegmentPostprocessor, ... (`self-rag-rse list` shows them all)",
    )
    download.add_argument(
        "--download-dir",
        "-d",
        required=True,
        metavar="DIR",
        help="folder to copy into (created if missing)",
    )
    download.add_argument(
        "--source",
        "--llama-pack-url",
        dest="llama_pack_url",
        metavar="PATH",
        default=None,
        help="copy from this checkout of the project (a folder or file:// URL) instead of "
        "the installed pack",
    )
    download.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME",
        help="also satisfy this optional-dependency group of the pack (repeatable), "
        "e.g. --extra llama-cpp",
    )
    for flag, text in (
        (
            "--overwrite",
            "replace the pack's files in a non-empty DIR: its package folder whole (files you "
            "added there go too), the project files one by one (other files are kept)",
        ),
        (
            "--use-existing",
            "if DIR already holds a copy, use it as it is (core's refresh_cache=False)",
        ),
        ("--no-install", "install nothing; print the pip command for missing requirements"),
    ):
        download.add_argument(flag, action="store_true", help=text)
    commands.add_parser("list", help="list the names download-llamapack accepts")
    add_evaluate_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 on success, 1 on a reported error)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "list":
        print("\n".join(public_names()))
        return 0
    if args.command == "evaluate":
        return run_evaluate(args, argv)
    try:
        found = download_llama_pack(
            args.llama_pack_class,
            download_dir=args.download_dir,
            llama_pack_url=args.llama_pack_url,
            refresh_cache=not args.use_existing,
            overwrite=args.overwrite,
            install_requirements=not args.no_install,
            extras=args.extra,
        )
    except (ValueError, OSError, RuntimeError, ImportError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    module = sys.modules.get(getattr(found, "__module__", ""))
    where = getattr(module, "__file__", None) or args.download_dir
    print(
        f"{args.llama_pack_class} is ready: {where}\n"
        f"Use the copy with: pip install -e {args.download_dir}\n"
        f"               or: PYTHONPATH={args.download_dir} python your_app.py"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
