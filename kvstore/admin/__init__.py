"""The admin surface: the HTTP port beside the gRPC one (`http.py`), the JSON documents it serves
(`api.py`), the observer that feeds metrics, the ledger and the explainer (`observer.py`), and the
composition for a running service (`server.py: start_admin`). Importing this package is cheap."""
