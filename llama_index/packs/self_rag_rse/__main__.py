"""``python -m llama_index.packs.self_rag_rse``: the ``self-rag-rse`` command (see :mod:`.cli`)."""

import sys

from llama_index.packs.self_rag_rse.cli import main

sys.exit(main())
