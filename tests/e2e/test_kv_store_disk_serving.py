"""The KV store's disk tier as a deployment starts it, on the tiny random model: `kvserve serve
--prefill-size 1 --decode-size 1 --kv-store-disk-path DIR` gives its store the tier, whose
figures reach the api's /metrics; `--kv-offloading-disk-path DIR` gives each engine's offload
store a folder of its own (DIR/engine-N).

Real processes (api, KV store, prefill and decode engine cores), real HTTP, the official openai
client; the store's memory tier holds a few blocks, so the prompts' blocks spill to disk, and
the disk tier a few files more, so it evicts.
"""

from __future__ import annotations

import os

import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.support.metrics import metrics_text, read_metric
from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.server import serving
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

# The tiny model's block: 16 tokens x K and V x 2 layers x 2 KV heads x 16 x 4 bytes = 8 KiB.
STORE_BYTES = 64 << 10  # 8 blocks in memory
DISK_BYTES = 160 << 10  # fewer than 20 files of a block and its header
# Distinct prompts of ~80 tokens (5 blocks each): 30 blocks in all, past both tiers.
PROMPTS = [f"Story {i}: " + " ".join(f"w{i}x{j}" for j in range(40)) for i in range(6)]


@pytest.fixture(scope="module")
def pd_disk_server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pd-disk")
    disk = folder / "disk"
    args = [tiny_llama_dir, "--served-model-name", "tiny", "--kv-cache-memory"]
    args += [str(TINY_KV_CACHE_MEMORY), "--prefill-size", "1", "--decode-size", "1"]
    args += ["--kv-store-size", str(STORE_BYTES), "--kv-store-disk-path", str(disk)]
    args += ["--kv-store-disk-bytes", str(DISK_BYTES)]
    with serving(args, str(folder / "serve.log")) as url:
        yield url, disk


def _disk_figures(url: str) -> dict[str, float]:
    text = metrics_text(url)
    names = ("bytes", "blocks", "blocks_written", "blocks_read", "blocks_evicted")
    figures = {
        name: read_metric(text, f"kvserve:kv_store_disk_{name}", engine="0") for name in names
    }
    figures["checksum_failures"] = read_metric(
        text, "kvserve:kv_store_disk_checksum_failures", engine="0"
    )
    return figures


def test_the_pd_store_spills_to_its_disk_tier_and_metrics_show_it(pd_disk_server):
    url, disk = pd_disk_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert _disk_figures(url)["blocks_written"] == 0  # the series exist before any write
    for prompt in PROMPTS:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)

    def evicted() -> bool:
        # An engine reads the store's figures at most once a second, and sends them with a
        # step: one more request carries the latest.
        client.completions.create(model="tiny", prompt="ping", max_tokens=1)
        return _disk_figures(url)["blocks_evicted"] > 0

    assert wait_until(evicted, timeout_s=30, interval_s=1.0), _disk_figures(url)
    figures = _disk_figures(url)
    assert figures["blocks_written"] > figures["blocks_evicted"] > 0
    assert 0 < figures["bytes"] <= DISK_BYTES
    assert figures["blocks"] > 0 and figures["checksum_failures"] == 0
    files = [name for _, _, names in os.walk(disk) for name in names if name.endswith(".kvb")]
    assert files, f"no block files under {disk}: {os.listdir(disk)}"


def test_each_offload_store_gets_a_disk_folder_of_its_own(tiny_llama_dir, tmp_path):
    disk = tmp_path / "offload-disk"
    llm = LLM(
        model=tiny_llama_dir,
        kv_cache_memory=TINY_KV_CACHE_MEMORY,
        kv_offloading_size=STORE_BYTES / 2**30,
        kv_offloading_disk_path=str(disk),
        kv_offloading_disk_bytes=DISK_BYTES,
    )
    # The store made the folder and holds its lock from start-up: the flags reached it.
    assert (disk / "engine-0" / ".lock").is_file()
    (output,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(output.outputs[0].token_ids) == 2
    del llm  # stops the engine and its store
