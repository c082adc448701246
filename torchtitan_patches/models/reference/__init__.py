"""The VLM built from TorchTitan blocks, with document-masked attention that also runs on CPU."""
