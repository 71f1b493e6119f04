"""What each vLLM release is: its facts extracted from its source (``facts``: defaults, names,
file markers), the names it accepts (``names``: KV cache dtypes, env vars), the differ that finds
where a memory rule's source moved (``diff``), and the installed build found without importing it
(``installed``).

May import: :mod:`tuner.errors` only. The bottom layer; imports neither torch nor vLLM.
"""
