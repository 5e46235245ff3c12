"""``sglang-memx serve``: several models behind one OpenAI-compatible router.

One module per job: ``config`` (models.yaml -> frozen dataclasses, errors by field),
``placement`` (checkpoint sizes -> FineServe Alg. 1), ``launcher`` (one SGLang server per
model, a shared pool per device, nothing left running on exit), ``admission`` (the router's
glue around ``memory_ext.policy.edf_admission``), ``router`` (FastAPI app: OpenAI routes by
``model``, native routes under ``/models/<name>/``), ``main`` (the command).

Nothing here imports sglang: engines are ``python -m sglang.launch_server`` subprocesses.
"""
