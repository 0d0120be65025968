"""A hidden-states connector with vLLM's stock file writer (no metadata) that runs on CPU: what a server
started with vLLM's own ``ExampleHiddenStatesConnector`` writes, for the refusal test (vLLM's connector
itself cannot copy without an accelerator). Loaded by the server through ``kv_connector_module_path``."""

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import ExampleHiddenStatesConnector

from peagle_data.extract.vllm_connector import CpuHiddenStatesConnector


class StockWriteCpuConnector(CpuHiddenStatesConnector):
    """peagle's CPU copy, vLLM's own ``_write_tensors`` (``save_file`` without metadata)."""

    _write_tensors = staticmethod(ExampleHiddenStatesConnector._write_tensors)
