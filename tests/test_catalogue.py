"""`--drafter auto`: published drafters found by the model's name through the catalogue, fetched
from a stand-in Hub (a tiny HTTP server that huggingface_hub is pointed at, no network), and
the hint discovery gives when it finds none."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants as hub_constants
import pytest

from redrafter_mlx.cli import main
from redrafter_mlx.io import catalogue
from redrafter_mlx.io.demo import write_demo_model
from redrafter_mlx.io.demo_drafters import write_demo_drafter
from redrafter_mlx.io.field_drafters import TYPES

SHA = "0123456789abcdef0123456789abcdef01234567"  # the one commit every stand-in repo is at
LOADED = {name for name, _, _ in TYPES}


class StandInHub:
    """Serves folders as Hub model repositories the way huggingface_hub asks for them: the
    revision's info (``/api/models/{repo}/revision/{rev}``), its file listing
    (``/api/models/{repo}/tree/{rev}``) and each file (``/{repo}/resolve/{rev}/{file}``,
    HEAD and GET); every other repository is 404. ``requests``: the paths asked for."""

    def __init__(self, repos: dict[str, Path]):
        self.repos, self.requests = repos, []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: pytest shows stderr of failures
                pass

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def _answer(self, body: bool):
                path = self.path.split("?")[0]
                hub.requests.append(path)
                for repo in hub.repos:
                    if path.startswith(f"/api/models/{repo}/revision/"):
                        info = {"id": repo, "sha": SHA, "siblings": hub._siblings(repo)}
                        return self._send(json.dumps(info).encode(), body, "application/json")
                    if path.startswith(f"/api/models/{repo}/tree/"):
                        tree = [{"type": "file", "path": s["rfilename"], "size": s["size"],
                                 "oid": SHA} for s in hub._siblings(repo)]  # fmt: skip
                        return self._send(json.dumps(tree).encode(), body, "application/json")
                    for name, file in hub.files(repo).items():
                        if path.startswith(f"/{repo}/resolve/") and path.endswith(f"/{name}"):
                            return self._send(file.read_bytes(), body, "application/octet-stream")
                    if path.startswith(f"/{repo}/"):
                        return self._missing("EntryNotFound")
                self._missing("RepoNotFound")

            def _send(self, data: bytes, body: bool, kind: str):
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Repo-Commit", SHA)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _missing(self, code: str):
                self.send_response(404)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Repo-Commit", SHA)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler

    def _siblings(self, repo: str) -> list[dict]:
        return [{"rfilename": n, "size": p.stat().st_size} for n, p in self.files(repo).items()]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    """A demo model and a random drafter of each loaded type for it, written once."""
    root = tmp_path_factory.mktemp("demo")
    model = write_demo_model(root / "model")
    out = {"model": model}
    for kind in ("dflash", "eagle3"):
        out[kind] = write_demo_drafter(root / kind, model, kind)
    return out


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """Point huggingface_hub at a stand-in Hub with an empty cache; ``hub(repos)`` starts it."""
    started = []
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")

    def start(repos: dict[str, Path]) -> StandInHub:
        server = StandInHub(repos)
        # what HF_ENDPOINT sets when huggingface_hub is imported (these tests import it first)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setattr(hub_constants, "ENDPOINT", server.url)
        template = server.url + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def named_copy(model: Path, where: Path, name: str) -> Path:
    """A copy of the model folder whose config records the Hub id ``name`` (``_name_or_path``,
    as transformers writes it): a local target the catalogue finds by that name."""
    where.mkdir()
    for f in model.iterdir():
        (where / f.name).write_bytes(f.read_bytes())
    config = json.loads((where / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**config, "_name_or_path": name}))
    return where


def generate(capsys, *args: str) -> tuple[dict, str]:
    main(["generate", "--prompt", "Hello there", "--max-tokens", "10", "--json", *args])
    out = capsys.readouterr()
    return json.loads(out.out), out.err


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("Qwen/Qwen3-8B", "qwen3-8b"),
        ("mlx-community/Qwen3-8B-4bit", "qwen3-8b"),
        ("Qwen/Qwen3-8B-MLX-bf16", "qwen3-8b"),
        ("mlx-community/Qwen3-8B-4bit-DWQ-053125", "qwen3-8b"),
        ("mlx-community/gpt-oss-20b-MXFP4-Q8", "gpt-oss-20b"),
        ("mlx-community/Meta-Llama-3.1-8B-Instruct-8bit", "meta-llama-3.1-8b-instruct"),
        ("Qwen/Qwen3.5-35B-A3B", "qwen3.5-35b-a3b"),
    ],
)
def test_quantized_copies_have_their_models_name(model, expected):
    assert catalogue.base_name(model) == expected


def test_the_target_is_named_by_its_id_its_cache_snapshot_or_its_config(tmp_path):
    assert catalogue.target_name("mlx-community/Qwen3-8B-4bit", {}) == "mlx-community/Qwen3-8B-4bit"
    snapshot = tmp_path / "models--mlx-community--Qwen3-8B-4bit" / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    assert catalogue.target_name(str(snapshot), {}) == "mlx-community/Qwen3-8B-4bit"
    assert catalogue.target_name(str(tmp_path), {"_name_or_path": "Qwen/Qwen3-8B"}) == (
        "Qwen/Qwen3-8B"
    )
    assert catalogue.target_name(str(tmp_path), {}) is None
    # an mlx-lm conversion records the model it converted in its card's base_model
    card = "---\nbase_model: google/gemma-4-31B-it\ntags:\n- mlx\n---\n"
    (tmp_path / "README.md").write_text(card)
    assert catalogue.target_name(str(tmp_path), {}) == "google/gemma-4-31B-it"
    (tmp_path / "README.md").write_text("---\nbase_model:\n- openai/gpt-oss-20b\n---\n# notes")
    assert catalogue.target_name(str(tmp_path), {"_name_or_path": "x/y"}) == "openai/gpt-oss-20b"
    (tmp_path / "README.md").write_text("my own notes, no metadata\n")
    assert catalogue.target_name(str(tmp_path), {}) is None


def test_the_catalogue_covers_the_models_the_docs_name_and_skips_what_it_cannot_load():
    known = catalogue.read_catalogue()
    needed = ["Qwen3-4B", "Qwen3-8B", "Qwen3.5-4B", "Qwen3.5-9B", "Qwen3.5-27B", "Qwen3.5-35B-A3B",
              "Qwen3.6-27B", "Qwen3.6-35B-A3B", "Qwen3.8-27B", "Llama-3.1-8B-Instruct",
              "gpt-oss-20b", "gemma-4-31B-it", "mlx-community/Qwen3-8B-4bit"]  # fmt: skip
    assert [n for n in needed if not known.get(catalogue.base_name(n))] == []
    entries = [e for es in known.values() for e in es]
    assert all(e.source and (e.repo or e.kind == "mtp") for e in entries)
    # a type we do not load is marked so: auto skips it with its reason, never fetches it
    assert all(e.unsupported for e in entries if e.kind not in LOADED)
    assert {e.kind for e in entries if e.unsupported is None} <= LOADED
    assert [e.type_name for e in known["qwen3.8-27b"]] == ["DFlash2"]


def test_auto_fetches_the_catalogues_drafter_for_a_hub_id(demo, hub, capsys, monkeypatch):
    """The target is served as Qwen/Qwen3-8B too: the whole path a user takes, on the stand-in;
    the answer is plain decoding's, and a second run offline reads the cached copy."""
    server = hub({"Qwen/Qwen3-8B": demo["model"], "z-lab/Qwen3-8B-DFlash-b16": demo["dflash"]})
    answer, err = generate(capsys, "--model", "Qwen/Qwen3-8B", "--drafter", "auto")
    drafter = Path(answer["drafter"]["path"])
    assert "models--z-lab--Qwen3-8B-DFlash-b16" in str(drafter)
    assert (drafter / "model.safetensors").read_bytes() == (
        demo["dflash"] / "model.safetensors"
    ).read_bytes()
    assert (
        "z-lab/Qwen3-8B-DFlash-b16 (DFlash), the catalogue's for Qwen3-8B"
        in (answer["drafter"]["reason"])
    )
    assert answer["mode"] == "redrafter"
    plain, _ = generate(capsys, "--model", "Qwen/Qwen3-8B", "--autoregressive")
    assert answer["tokens"] == plain["tokens"]
    # cached: a second run offline uses the copy it fetched, asking the Hub nothing
    server.requests.clear()
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    again, _ = generate(capsys, "--model", "Qwen/Qwen3-8B", "--drafter", "auto")
    assert again["drafter"]["path"] == str(drafter) and server.requests == []


def test_auto_passes_over_a_missing_repo_and_one_that_does_not_fit(demo, hub, capsys, tmp_path):
    """The DFlash repo is absent, the first EAGLE-3 one made for another size: the next fits.
    The misfit is refused by its config alone: its weights are never fetched."""
    wide = tmp_path / "wide-eagle3"
    wide.mkdir()
    config = json.loads((demo["eagle3"] / "config.json").read_text())
    config["target_hidden_size"] *= 2  # made for a model twice as wide
    (wide / "config.json").write_text(json.dumps(config))
    (wide / "model.safetensors").write_bytes((demo["eagle3"] / "model.safetensors").read_bytes())
    server = hub({"RedHatAI/gpt-oss-20b-speculator.eagle3": wide,
                  "nebius/EAGLE3-gpt-oss-20b": demo["eagle3"]})  # fmt: skip
    model = named_copy(demo["model"], tmp_path / "gpt", "openai/gpt-oss-20b")
    answer, err = generate(capsys, "--model", str(model), "--drafter", "auto")
    assert "models--nebius--EAGLE3-gpt-oss-20b" in answer["drafter"]["path"]
    assert "z-lab/gpt-oss-20b-DFlash (DFlash): not found on the Hub" in err
    refused = "RedHatAI/gpt-oss-20b-speculator.eagle3 (EAGLE-3): EAGLE-3 drafter reads hidden size"
    assert refused in err
    assert not [r for r in server.requests if "speculator.eagle3" in r and "safetensors" in r]


def test_auto_offline_falls_back_to_discovery_and_says_what_it_would_fetch(
    demo, hub, capsys, tmp_path, monkeypatch
):
    hub({})
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    model = named_copy(demo["model"], tmp_path / "qwen", "Qwen/Qwen3-8B")
    answer, _ = generate(capsys, "--model", str(model), "--drafter", "auto")
    assert answer["drafter"]["path"] is None
    reason = answer["drafter"]["reason"]
    assert "--drafter auto: offline" in reason
    assert "would have fetched z-lab/Qwen3-8B-DFlash-b16 (DFlash) for Qwen3-8B" in reason
    assert answer["tokens"]  # it still answers, with lookup beams


def test_auto_skips_types_not_loaded_yet_with_a_line(demo, hub, capsys, tmp_path, monkeypatch):
    """Every published type in the shipped catalogue loads now; a catalogue entry marked
    unsupported, or of a type with no loader, is skipped with its reason and never fetched."""
    server = hub({})
    listed = {
        "models": [
            {
                "target": "google/gemma-4-12B-it",
                "drafters": [
                    {"repo": "x/held", "type": "dflash", "unsupported": "held back: a reason",
                     "source": "test"},
                    {"repo": "x/new-kind", "type": "laguna", "source": "test"},
                ],
            }
        ]
    }  # fmt: skip
    (tmp_path / "catalogue.json").write_text(json.dumps(listed))
    shipped = catalogue.read_catalogue
    monkeypatch.setattr(catalogue, "read_catalogue", lambda: shipped(tmp_path / "catalogue.json"))
    model = named_copy(demo["model"], tmp_path / "g12", "google/gemma-4-12B-it")
    main(["generate", "--model", str(model), "--drafter", "auto", "--prompt", "Hi",
          "--max-tokens", "4"])  # fmt: skip
    err = capsys.readouterr().err
    assert "x/held (DFlash): held back: a reason" in err
    assert "x/new-kind (" in err and "not loaded yet" in err
    assert "no catalogue drafter for google/gemma-4-12B-it fits" in err
    assert server.requests == []  # nothing fetched for a type it cannot load


def test_without_drafter_discovery_names_the_catalogues_drafter_and_fetches_nothing(
    demo, hub, capsys, tmp_path
):
    server = hub({"z-lab/Qwen3-8B-DFlash-b16": demo["dflash"]})
    model = named_copy(demo["model"], tmp_path / "qwen", "mlx-community/Qwen3-8B-4bit")
    main(["generate", "--model", str(model), "--prompt", "Hi", "--max-tokens", "4"])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("drafter:")]
    assert len(lines) == 1
    assert "the catalogue lists z-lab/Qwen3-8B-DFlash-b16 (DFlash) for Qwen3-8B" in lines[0]
    assert "--drafter auto downloads it once" in lines[0]
    assert server.requests == []


def test_auto_passes_over_an_mtp_head_the_copy_does_not_carry(demo, hub, capsys, tmp_path):
    """Qwen3.5-4B's entries: z-lab's DFlash drafter (absent here), then the checkpoint's own
    MTP head, which a conversion (here: the demo model) does not carry."""
    hub({})
    model = named_copy(demo["model"], tmp_path / "q35", "mlx-community/Qwen3.5-4B-MLX-4bit")
    answer, err = generate(capsys, "--model", str(model), "--drafter", "auto")
    assert answer["drafter"]["path"] is None
    assert "Qwen3.5-4B's own checkpoint (MTP): this copy has no MTP head" in err
    assert "no catalogue drafter for Qwen3.5-4B fits" in answer["drafter"]["reason"]
