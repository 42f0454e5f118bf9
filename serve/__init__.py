"""The serving side: engine loop, scheduler, KV block manager, sampler, OpenAI-compatible server.

Uses only the public ``CompiledModel`` contract of the core.
"""
