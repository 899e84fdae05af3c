"""Retrieval tasks: synthetic MQAR and needle datasets (``tasks``) and natural-language
passkey prompts for pretrained models (``passkey``). Imports only ``core``."""
