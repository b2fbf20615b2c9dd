"""Online serving: the OpenAI-compatible HTTP server (`trtopt serve`) and the Triton model repository
generator (`trtopt triton-repo`). The HTTP pieces import fastapi lazily through their own modules, so
`trtopt.serving.triton_repo` works without the `serve` extra.
"""
