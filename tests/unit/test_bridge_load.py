"""The bridge's reading of a vLLM server's /metrics: the load its heartbeat reports."""

from __future__ import annotations

from bridge.engine_load import parse_metrics

# As vLLM 0.32 renders them (two engines of one server: data parallel), trimmed to what is read.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="1",num_gpu_blocks="100"} 1.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7962e+09
"""


def test_the_load_of_every_engine_is_summed_and_the_pool_counted_in_kvroute_blocks() -> None:
    load = parse_metrics(VLLM_METRICS, block_size=16)
    assert (load.num_running, load.num_waiting) == (4, 2)
    assert load.kv_total_pages == 2 * 100 * 8  # 128-token blocks are 8 kvroute blocks each
    assert load.kv_used_pages == round(1600 * 0.375)  # the engines' usage averaged
    assert load.started_at == 1.7962e09
    assert load.waiting_prefill_tokens == 0 and load.by_source is None


def test_a_server_that_reports_nothing_yet_is_idle_and_empty() -> None:
    load = parse_metrics("# nothing yet\n", block_size=16)
    assert (load.num_running, load.num_waiting, load.kv_total_pages, load.kv_used_pages) == (0, 0, 0, 0)
    assert load.started_at is None
