"""What operators see of the service: each finished call (`records.CallRecord`, delivered after it
answers by `queue.ObserverQueue`) feeds the Prometheus metrics (`metrics.py`), the three-bills ledger
(`ledger.py`), the miss explainer (`explainer.py`), the TTL policy's return tracker (`returns.py`)
and the request trace (`trace_recorder.py` writing `trace_file.py`'s format, which `ttl_tuning.py`
reads back). `admin_http.py` and `admin_api.py` serve them on the admin port. Observers never
import the service; the composition root hands them what they read."""
