"""Osawa et al., CVPR 2019: large-batch distributed K-FAC, ResNet-50 on ImageNet.

``python -m reproductions.osawa2018.train`` trains with the paper's recipe,
``python -m reproductions.osawa2018.study`` runs the small-scale large-batch study and
``python -m reproductions.osawa2018.tables`` rebuilds the paper's tables; see README.md.
"""
