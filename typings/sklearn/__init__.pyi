# The parts of scikit-learn that fdp's examples use (scikit-learn ships no types).
