"""One module per op family; each reads top to bottom: public function, shape rule,
reference, primitives, abstract eval, lowerings, batching, JVP, transpose."""
