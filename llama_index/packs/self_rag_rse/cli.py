"""The ``self-rag-rse`` command: ``download-llamapack`` with the legacy CLI's shape, offline.

``self-rag-rse download-llamapack SelfRAGPack --download-dir ./pack`` (or
``python -m llama_index.packs.self_rag_rse ...``) does what
``llamaindex-cli download-llamapack`` did for other packs, by :func:`.download.download_llama_pack`.
``self-rag-rse evaluate --docs DIR --qa FILE.jsonl --out OUTDIR`` compares top-k, RSE and Self-RAG
engines on your data (:mod:`.evaluation.command`).

Parsing imports nothing heavy: ``--help`` and a mistyped flag answer at once, and a command
imports what it needs once it runs (``evaluate``: llama-index-core, seconds).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from llama_index.packs.self_rag_rse.download import DISTRIBUTION, download_llama_pack, public_names
from llama_index.packs.self_rag_rse.evaluation import flags

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


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors name the closest command, choice or flag.

    ``evaluat`` gets "did you mean 'evaluate'?", ``--top-kk 3`` "did you mean '--top-k'?".
    Python 3.14's ``suggest_on_error`` covers choices only, and 3.10 has none. Its
    subcommands' parsers are of this class too (argparse makes them of the parent's class).
    """

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's one check of a value against its choices (a command's name included).
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as error:
            choices = [str(choice) for choice in action.choices or ()]
            hint = did_you_mean([str(value)], choices)
            raise argparse.ArgumentError(action, error.message + hint) from None

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        """As argparse's, but an unknown argument is an error here, naming the closest flag.

        The command takes no argument it does not know, so each (sub)command refuses them
        itself, with its own usage, where argparse would leave them to the top parser.
        """
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            typed = [extra.split("=", 1)[0] for extra in extras if extra.startswith("-")]
            # argparse keeps no public list of a parser's flags.
            hint = did_you_mean(typed, list(self._option_string_actions))
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed, extras


def did_you_mean(typed: Sequence[str], known: Sequence[str]) -> str:
    """``" (did you mean 'X'?)"``, naming the closest of ``known`` to each of ``typed`` that
    has one close enough; ``""`` when none has.
    """
    close = []
    for text in typed:
        close += difflib.get_close_matches(text, known, n=1)
    if not close:
        return ""
    return f" (did you mean {', '.join(map(repr, close))}?)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``self-rag-rse`` command."""
    parser = CommandParser(
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
    download.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the pack's files in a non-empty DIR: its package folder whole (files you "
        "added there go too), the project files one by one (other files are kept)",
    )
    download.add_argument(
        "--use-existing",
        action="store_true",
        help="if DIR already holds a copy, use it as it is (core's refresh_cache=False)",
    )
    download.add_argument(
        "--no-install",
        action="store_true",
        help="install nothing; print the pip command for missing requirements",
    )
    commands.add_parser("list", help="list the names download-llamapack accepts")
    flags.add_evaluate_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 on success, 1 on a reported error;
    argparse exits with 2 on a usage error, ``evaluate`` returns 130 on Ctrl-C).
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "list":
        print("\n".join(public_names()))
        return 0
    if args.command == "evaluate":
        return flags.run(args, argv)
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
