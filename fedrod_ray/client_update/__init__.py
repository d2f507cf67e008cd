"""One client update: E local epochs (``local``), one mini-batch's step (``step``), many clients'
updates in one batched pass (``batched``) and the empirical and balanced risks they minimise (``losses``).
"""
