"""The algorithms behind the preparation commands of ``data_prep/``: CHEERS' change entities
(``change_entities``) and their retrieval (``entity_retrieval``), IDC-PCL's hard negatives
(``negative_mining``). The commands add the flags; ``data_prep/first_use.py`` runs them with
the commands' defaults for the built-in synthetic set."""
