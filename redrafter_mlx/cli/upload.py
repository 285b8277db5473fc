"""`redrafter-mlx upload`: share a drafter folder on the Hugging Face Hub with its model card.

Uploads what loading needs and what describes it (``config.json``, ``model.safetensors``,
``target.json``, the card ``README.md``, ``train_log.jsonl``), never the training checkpoint.
``--dry-run`` writes the card and lists the files, and touches no network.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from redrafter_mlx.cli import flags
from redrafter_mlx.core.errors import ConfigError
from redrafter_mlx.io.card import write_card
from redrafter_mlx.io.checks import looks_like_hub_id, one_line
from redrafter_mlx.io.drafters import TARGET_FILE

# The files of a drafter folder that go to the Hub (checkpoint/ and temp files stay)
SHARED_FILES = ("config.json", "model.safetensors", TARGET_FILE, "README.md", "train_log.jsonl")
REQUIRED = ("config.json", "model.safetensors")

EPILOG = """examples:
  # see the card and the files first (no network); drafters/demo: see `train --help`
  redrafter-mlx upload --drafter drafters/demo --repo you/demo-redrafter --model you/demo \\
      --dry-run
  # then upload (needs `hf auth login` or HF_TOKEN)
  redrafter-mlx upload --drafter drafters/demo --repo you/demo-redrafter
  # others then load it by its id
  redrafter-mlx chat --model models/demo --drafter you/demo-redrafter
"""


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Upload a drafter folder to the Hugging Face Hub, with a model card.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--drafter", required=True, help="drafter folder (as `train --out` wrote it)")
    p.add_argument("--repo", required=True, help="Hub repository USER/NAME (created if missing)")
    p.add_argument(
        "--model",
        help="the target as others load it, e.g. its Hub id, for the card (default: what "
        "train recorded, often a local folder)",
    )
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument(
        "--dry-run", action="store_true", help="write the card, list the files; no network"
    )
    return p


def shared_files(folder: Path) -> list[Path]:
    """The files of ``folder`` that the Hub gets; ConfigError when it is no drafter folder."""
    if not folder.is_dir():
        raise ConfigError(f"--drafter {folder}: not a folder")
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        raise ConfigError(f"--drafter {folder}: no {' or '.join(missing)} (not a drafter folder)")
    return [folder / name for name in SHARED_FILES if (folder / name).is_file()]


@flags.reports_errors
def main(args: argparse.Namespace) -> None:
    folder = Path(args.drafter).expanduser()
    if not looks_like_hub_id(args.repo):
        raise ConfigError(f"--repo {args.repo!r}: expected USER/NAME")
    shared_files(folder)  # refuse a wrong folder before writing the card into it
    card = write_card(folder, drafter=args.repo, model=args.model)
    files = shared_files(folder)
    size = sum(f.stat().st_size for f in files)
    for f in files:
        print(f"{f.name}\t{f.stat().st_size:,} bytes")
    if args.dry_run:
        print(
            f"dry run: wrote {card}; would upload these {len(files)} files "
            f"({size / 1e6:.1f} MB) to https://huggingface.co/{args.repo}",
            file=sys.stderr,
        )
        return
    url = upload(folder, args.repo, [f.name for f in files], private=args.private)
    print(f"uploaded {len(files)} files to {url}", file=sys.stderr)
    print(f"load it with: --drafter {args.repo}", file=sys.stderr)


def upload(folder: Path, repo: str, names: list[str], *, private: bool) -> str:
    """Create ``repo`` (kept if it exists) and upload ``names`` of ``folder`` in one commit;
    the repository's URL. Hub failures are one ConfigError line."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(
            repo_id=repo,
            folder_path=str(folder),
            allow_patterns=names,
            commit_message="Upload ReDrafter drafter (redrafter-mlx upload)",
        )
    except Exception as e:  # network, auth and Hub errors come in many types
        raise ConfigError(f"upload to {repo} failed: {one_line(e)}") from None
    return str(url)
