"""What rewritten graphs call at run time: autograd-correct collectives and parallel ops."""
