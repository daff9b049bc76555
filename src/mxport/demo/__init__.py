"""The processes behind ``mxport refit``: trainers that train the model a few steps and engines that take each
refit, check it and generate. They use the library as a user would; the library never imports this package.

- :mod:`.procs`: spawn a world of processes on loopback, collect their messages, leave nothing running;
- :mod:`.single`: one trainer rank and R mxport engine ranks (``mxport refit``);
- :mod:`.mesh`: T trainer ranks and E engine ranks, shard to shard (``--trainer ... --engine tp=N``);
- :mod:`.vllm`: one trainer process and a real vLLM engine through the "mxport" weight-transfer backend
  (``--engine vllm``).
"""
