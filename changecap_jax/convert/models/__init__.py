"""One checkpoint converter per model, each a module whose ``CONVERTER`` the registry lists
(``changecap_jax/convert/registry.py``, docs/converters.md); ``tuyunbin`` and
``idc_dict_json`` are parts that converters share or lean on, not converters."""
