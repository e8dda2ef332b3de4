"""Serving the policy over HTTP: the OpenAI-compatible endpoint (`megarl serve`, agents written against the `openai`
client).

    openai_protocol  requests validated up front (OpenAI error bodies naming the field), chat rendering with the
                     tokenizer's template, tool calls parsed into OpenAI's `tool_calls`, the token ids and log-probs
                     of every response recorded; no HTTP in it
    openai_api       the FastAPI/uvicorn adapter over it (routes, per-session base URLs, body-size limit, bearer
                     token, client disconnects, 429 past the in-flight bound, SSE), and `serve_model` behind
                     `megarl serve`
    segments         one session's recorded responses -> token-exact segments by the delta rule
    agents           agent environments (`rollout.env: agent:file.py:run`): agents written against the openai
                     client, one session per episode, their segments trained as trajectories
"""
