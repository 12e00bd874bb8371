"""python -m reshard.vllm layout MODEL_DIR --tp N -o MAPS.json"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reshard.vllm",
        description="reshard and vLLM: layouts learned from vLLM's own weight loaders.")
    sub = parser.add_subparsers(dest="command", required=True)
    lay = sub.add_parser(
        "layout", help="write the map document of a model's tensors onto vLLM's parameters",
        description="Learns vLLM's layout of MODEL_DIR at --tp ranks by running vLLM's weight "
                    "loaders on marker tensors, and writes it as a version-2 map document "
                    "(buffers: vLLM's parameters), for `reshard scatter --maps`.")
    lay.add_argument("model_dir", metavar="MODEL_DIR", help="a Hugging Face checkpoint directory")
    lay.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    lay.add_argument("-o", "--output", required=True, metavar="MAPS.json",
                     help="where to write the map document ('-' for stdout)")
    lay.add_argument("--dtype", default="auto",
                     help="the dtype vLLM holds, as LLM(dtype=...) (default auto)")
    lay.add_argument("--no-cache", action="store_true",
                     help="learn the layout again rather than read the cache")
    lay.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)
    if args.tp < 1:
        parser.error(f"--tp {args.tp}: a tensor parallel size is at least 1")
    from .layout import LayoutError, _MalformedInput, layout
    try:
        doc = layout(args.model_dir, args.tp, dtype=args.dtype, cache=not args.no_cache,
                     trust_remote_code=args.trust_remote_code)
    except ImportError as e:
        print(f"error: vLLM is not importable here: {e}", file=sys.stderr)
        return 3
    except (FileNotFoundError, _MalformedInput) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from .._buffers import read_buffers
    buffers = read_buffers(doc)
    text = buffers.to_json() if buffers is not None else json.dumps(doc)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
