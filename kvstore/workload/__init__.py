"""The agentic workload benchmark (`kvstore bench workload`): a deterministic generator of agent
sessions, a simulated mode over byte-accounting models of the store, pool and replay (with the real
policies), a live mode against the service, the cliff sweep, and the report.

Modules: `generator` (sessions and turns), `thinktime` (gap distributions), `storemodel` and
`poolmodel` (byte accounting), `costmodel` (TTFT and GPU time), `simulator` (the event loop),
`results` (figures and bills), `sweep` (the cliff), `live` (the real service), `report` (tables and
plot), `tracing` (trace records for `kvstore tune`).
"""
