from experiments.acceptance import main

main()
