"""`redrafter-mlx upload`: share a drafter folder on the Hugging Face Hub with its model card.

Uploads what loading needs and what describes it (``config.json``, ``model.safetensors``,
``target.json``, ``train_log.jsonl``) with a card made for the repository as ``README.md``,
never the training checkpoint; the folder itself is left as it is. A folder that holds no
drafter and a repository name the Hub would refuse are refused first. ``--dry-run`` lists the
files and writes and sends nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from redrafter_mlx.cli import flags
from redrafter_mlx.core.errors import ConfigError
from redrafter_mlx.io.card import CARD_NAME, card_text
from redrafter_mlx.io.checks import one_line
from redrafter_mlx.io.drafters import TARGET_FILE, drafter_problem

# The files of a drafter folder that go to the Hub (checkpoint/ and temp files stay)
SHARED_FILES = ("config.json", "model.safetensors", TARGET_FILE, "README.md", "train_log.jsonl")
REQUIRED = ("config.json", "model.safetensors")

EPILOG = """examples:
  # see the files first (nothing written, no network); drafters/demo: see `train --help`
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
        "--dry-run", action="store_true", help="list the files; nothing written, no network"
    )
    return p


def shared_files(folder: Path) -> list[Path]:
    """The files of ``folder`` that the Hub gets besides the card; ConfigError when it holds
    no drafter (a model folder, a config alone, cut weights)."""
    if problem := drafter_problem(folder):
        raise ConfigError(f"--drafter {folder}: {problem}")
    return [folder / name for name in SHARED_FILES if (folder / name).is_file()]


# The Hub's rule for a repository id (huggingface_hub.utils.validate_repo_id, the Hub's own)
HUB_RULE = (
    "the Hub takes USER/NAME, each 1 to 96 characters of A-Z, a-z, 0-9, '-', '_' and '.', "
    "not starting or ending with '-' or '.', without '--' or '..', not ending in '.git'"
)


def check_repo(repo: str) -> None:
    """ConfigError, with the Hub's rule, for a repository id the Hub would refuse: checked
    before anything is written or sent."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise ConfigError(f"--repo {repo!r}: not a repository name ({HUB_RULE})") from None
    if repo.count("/") != 1:  # the Hub takes a bare NAME as the user's: we ask for both
        raise ConfigError(f"--repo {repo!r}: expected USER/NAME ({HUB_RULE})")


@flags.reports_errors
def main(args: argparse.Namespace) -> None:
    folder = Path(args.drafter).expanduser()
    check_repo(args.repo)
    files = shared_files(folder)
    card = card_text(folder, drafter=args.repo, model=args.model).encode()
    sizes = {f.name: f.stat().st_size for f in files if f.name != CARD_NAME}
    sizes[CARD_NAME] = len(card)  # the card upload writes, not a README.md already there
    names = [name for name in SHARED_FILES if name in sizes]
    for name in names:
        print(f"{name}\t{sizes[name]:,} bytes")
    total = sum(sizes.values())
    if args.dry_run:
        print(
            f"dry run: nothing written or sent; would upload these {len(names)} files "
            f"({total / 1e6:.1f} MB) to https://huggingface.co/{args.repo}, {CARD_NAME} the "
            "card made for it",
            file=sys.stderr,
        )
        return
    url = upload(
        folder, args.repo, [n for n in names if n != CARD_NAME], card, private=args.private
    )
    print(f"uploaded {len(names)} files to {url}", file=sys.stderr)
    print(f"load it with: --drafter {args.repo}", file=sys.stderr)


def upload(folder: Path, repo: str, names: list[str], card: bytes, *, private: bool) -> str:
    """Create ``repo`` (kept if it exists) and upload ``names`` of ``folder`` and ``card`` as
    its README.md in one commit (the folder is left as it is); the repository's URL. Hub
    failures are one ConfigError line."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi()
    files = [CommitOperationAdd(name, str(folder / name)) for name in names]
    try:
        url = api.create_repo(repo, private=private, exist_ok=True)
        api.create_commit(
            repo_id=repo,
            operations=[*files, CommitOperationAdd(CARD_NAME, card)],
            commit_message="Upload ReDrafter drafter (redrafter-mlx upload)",
        )
    except Exception as e:  # network, auth and Hub errors come in many types
        raise ConfigError(f"upload to {repo} failed: {one_line(e)}") from None
    return str(url)
