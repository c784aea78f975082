"""The target as a serving engine holds it: EAGLE-3 features from vLLM's `extract_hidden_states`.

A target no single device holds (Kimi-K2.5: ~550 GB over 8 GPUs) is already loaded by the engine
that serves it. vLLM started with the speculative method `extract_hidden_states` and a
hidden-states KV connector (serve.py: `server_argv(..., extract_layer_ids=...)`) caches, for every
prompt token, the hidden states of the configured layer ids and writes them per request to one
safetensors file: `hidden_states` [tokens, n_ids, H] and `token_ids` [tokens], path in the
completion's `kv_transfer_params.hidden_states_path`, a `.lock` beside it held by the writer until
the file is whole (only TP rank 0 writes). vLLM's id t is the input to layer t (the residual
stream after layer t-1), so the aux ids mean what specops' in-process hooks mean, and id L (the
layer count) is the last layer's output before the final norm: the `final` feature.

`ServedTarget.rows_features` sends each row's token ids as a `max_tokens = 1` completion (rows in
parallel, spread over the servers: data-parallel replicas), takes each file under its lock, checks
that the ids the server saw are the ids sent, and returns the batch as extract stores it. Costs:
one prefill per sample on the server, plus a file of tokens x (n_aux + 1) x H x 4 bytes (fp32 on
the CPU build; the model dtype on GPUs) through the shared file system, removed once read.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import SpecopsError
from .conventions import TextShape, aux_layer_ids_problem

__all__ = ["ServedTarget", "extract_speculative_config", "connector_config", "PLUGIN_DIR", "CONNECTOR"]

PLUGIN_DIR = Path(__file__).parent / "vllm_plugin"  # on the server's PYTHONPATH
CONNECTOR = ("SpecopsHiddenStatesConnector", "specops_hidden_states")  # class, module


def extract_speculative_config(layer_ids: Sequence[int], num_hidden_layers: int) -> dict[str, Any]:
    """vLLM's --speculative-config for features: the aux ids, then L (the pre-norm final state)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": [*map(int, layer_ids), int(num_hidden_layers)]}}}


def connector_config(storage_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """vLLM's --kv-transfer-config: specops' connector (target/vllm_plugin), files under storage_dir."""
    name, module = CONNECTOR
    return {"kv_connector": name, "kv_connector_module_path": module, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}


def _error_text(e: urllib.error.HTTPError) -> str:
    """The server's own words for a refused request: the JSON error message vLLM and SGLang send
    ({"error": {"message": ...}}, or "message" / "detail"), else the body's first 500 characters."""
    try:
        body = e.read().decode("utf-8", "replace")
    except OSError:
        return str(e.reason)
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500] or str(e.reason)
    err = data.get("error") if isinstance(data, dict) else None
    msg = (err.get("message") if isinstance(err, dict) else err) or (
        (data.get("message") or data.get("detail")) if isinstance(data, dict) else None)
    return str(msg or body[:500])


class ServedTarget(TextShape):
    """The FeatureSource of a target behind vLLM servers (module docstring)."""

    def __init__(self, urls: Sequence[str], *, model: str, config: Any, model_dir: Path, layer_ids: Sequence[int],
                 concurrency: int = 32, timeout_s: float = 600.0, attempts: int = 3,
                 api_key: str | None = None) -> None:
        if not urls:
            raise SpecopsError("served extract: no server url")
        self.urls = [u.rstrip("/") for u in urls]
        self.model, self.config, self.model_dir = model, config, Path(model_dir)
        L = self.num_hidden_layers
        problem = aux_layer_ids_problem(list(layer_ids), L)
        if problem:
            raise SpecopsError(problem)
        self.layer_ids = [int(i) for i in layer_ids]
        self.device = torch.device("cpu")  # features arrive through files, on the host
        self.dtype = torch.float32
        self.timeout_s, self.attempts, self.api_key = timeout_s, attempts, api_key
        self._next = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="served-extract")
        self.requests = 0  # completions sent (the tests and the log read it)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- one request

    def _post(self, url: str, ids: list[int]) -> dict[str, Any]:
        return self._post_json(f"{url}/completions",
                               {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0})

    def _post_json(self, endpoint: str, payload: dict[str, Any]) -> dict[str, Any]:
        from ..auth import auth_headers

        headers = {"Content-Type": "application/json", **auth_headers(self.api_key)}
        req = urllib.request.Request(endpoint, data=json.dumps(payload).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read())

    # How a server must be started to answer with features (named in refusals and missing states).
    hint = ("is it started with --speculative-config extract_hidden_states and a hidden-states "
            "--kv-transfer-config (specops serve does both)?")

    def _request(self, sent: list[int]) -> tuple[str, dict[str, Any]]:
        """(url, response) of one sample's request, the servers taken round-robin. A connection
        failure, a timeout, a 5xx, 408 or 429 is tried again (`attempts` in all); any other 4xx is the
        server refusing the request itself (no flag for states, a prompt too long) and fails at once."""
        err: Exception | None = None
        for attempt in range(self.attempts):
            with self._lock:
                url = self.urls[next(self._next)]
                self.requests += 1
            try:
                return url, self._post(url, sent)
            except urllib.error.HTTPError as e:
                if e.code < 500 and e.code not in (408, 429):
                    raise SpecopsError(f"served extract: {url} refused a {len(sent)}-token request (HTTP "
                                       f"{e.code}: {_error_text(e)}); {self.hint}") from None
                err = e
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                err = e
            time.sleep(min(2.0 ** attempt, 10.0))
        raise SpecopsError(f"served extract: {len(sent)}-token request failed {self.attempts} times: {err}")

    def _row(self, ids: torch.Tensor) -> torch.Tensor:
        """One sample's ids [T] -> its states [T, n_ids + 1, H] (fp32)."""
        from safetensors.torch import load_file

        sent = [int(t) for t in ids.tolist()]
        url, resp = self._request(sent)
        path = ((resp.get("kv_transfer_params") or {}).get("hidden_states_path")
                or ((resp.get("choices") or [{}])[0].get("kv_transfer_params") or {}).get("hidden_states_path"))
        if not path:
            raise SpecopsError(f"served extract: {url} returned no kv_transfer_params.hidden_states_path; {self.hint}")
        lock = path + ".lock"
        try:
            with open(lock) as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)  # sleeps until the writer's LOCK_EX goes
                data = load_file(path, device="cpu")
        except FileNotFoundError as e:
            raise SpecopsError(f"served extract: {path} (or its .lock) is not here: the servers must write to a "
                               f"directory this process reads ({e})") from None
        finally:
            for p in (path, lock):
                try:
                    os.remove(p)
                except FileNotFoundError:
                    pass
        seen = data["token_ids"].tolist()
        if seen != sent:
            first = next((i for i, (a, b) in enumerate(zip(seen, sent)) if a != b), min(len(seen), len(sent)))
            raise SpecopsError(f"served extract: the server saw other token ids than sent ({len(seen)} vs "
                               f"{len(sent)} tokens, first difference at {first})")
        hs = data["hidden_states"]
        want = (len(sent), len(self.layer_ids) + 1, self.hidden_size)
        if tuple(hs.shape) != want:
            raise SpecopsError(f"served extract: hidden_states {tuple(hs.shape)}, expected {want} (tokens, the "
                               "aux ids + the final state, hidden): a server started with other layer ids?")
        return hs.float()

    # -- a batch

    def rows_features(self, rows: Sequence[torch.Tensor | None], T: int) -> dict[str, torch.Tensor]:
        """Rows of token ids (None: a row not to request, left zero) -> {"aux": [B, T, n_aux, H],
        "final": [B, T, H]} fp32 on the host, right-padded like the in-process batch."""
        B, n, H = len(rows), len(self.layer_ids), self.hidden_size
        aux = torch.zeros(B, T, n, H)
        final = torch.zeros(B, T, H)
        futures = {self._pool.submit(self._row, r): b for b, r in enumerate(rows) if r is not None and len(r)}
        try:
            for fut in concurrent.futures.as_completed(futures):
                b = futures[fut]
                hs = fut.result()
                aux[b, : hs.shape[0]] = hs[:, :n]
                final[b, : hs.shape[0]] = hs[:, n]
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
        return {"aux": aux, "final": final}
