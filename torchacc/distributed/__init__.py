"""The lowest torchacc layer above ``_utils``: the torchrun environment and process group (``env``),
collectives with TorchAcc's names (``collectives``) and the device mesh (``mesh``).

It imports nothing above it. The public name is ``torchacc.dist`` (see ``torchacc/dist/``).
"""
