"""Special token ids, fixed project-wide.

Every SentencePiece model that mt trains reserves these ids, every batch pads with PAD, and a
checkpoint records them so a model is never paired with a vocabulary that disagrees.
"""

PAD = 0  # padding: ignored by attention and the loss
UNK = 1  # unknown piece
BOS = 2  # beginning of sentence: the first decoder input
EOS = 3  # end of sentence: appended to source and target

SPECIALS = {"pad": PAD, "unk": UNK, "bos": BOS, "eos": EOS}
